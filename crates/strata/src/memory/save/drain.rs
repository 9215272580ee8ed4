//! A background snapshot's stream outlives its saver: a forked child holds the migration
//! socket and, if the saver dies (kill -9) before it says it is done, reads the rest of the
//! stream into nothing so QEMU's snapshot completes.
//!
//! Why: QEMU 7.2 write-protects the guest's RAM (userfaultfd) for a background snapshot and
//! lifts the protection only when the snapshot completes; a snapshot that fails or is
//! cancelled once the protection is on (its receiver gone, `migrate_cancel`) leaves every page
//! it had not sent yet protected with nobody to resolve the faults, and the first vCPU to
//! write one blocks forever while QMP still says "running" (later QEMUs stop the tracking on
//! failure too). A drained snapshot is simply never committed: no ref, garbage for GC.
//!
//! The child, not the saver, accepts QEMU's connection and passes it to the saver over a
//! socket pair (`SCM_RIGHTS`), so no instant exists at which the saver alone holds the stream.
//! It then waits on the pair: a byte means the saver is done with the stream (whatever the
//! outcome), end of file means the saver is gone. A saver gone before QEMU connected leaves
//! the child to accept and drain (up to the connect timeout). The child runs only raw system
//! calls (it is forked from a threaded process), keeps no descriptor but its two, and starts
//! its own session so a terminal's Ctrl-C to the saver does not reach it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::time::{Duration, Instant};

/// The saver's side of the drain child.
pub(super) struct Drainer {
    pid: libc::pid_t,
    ctl: Option<OwnedFd>,
}

fn last_os_error<T>(_: T) -> io::Error {
    io::Error::last_os_error()
}

impl Drainer {
    /// Fork the child holding `listener` (see the module comment); it waits for QEMU's
    /// connection for at most `timeout`.
    pub(super) fn start(listener: &UnixListener, timeout: Duration) -> io::Result<Drainer> {
        let mut pair = [0 as RawFd; 2];
        // SAFETY: a valid two-element array for socketpair to fill.
        if unsafe {
            libc::socketpair(
                libc::AF_UNIX,
                libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
                0,
                pair.as_mut_ptr(),
            )
        } != 0
        {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: socketpair returned two new descriptors this function owns.
        let (ours, theirs) =
            unsafe { (OwnedFd::from_raw_fd(pair[0]), OwnedFd::from_raw_fd(pair[1])) };
        let timeout_ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        let lfd = listener.as_raw_fd();
        let cfd = theirs.as_raw_fd();
        // SAFETY: the child calls only async-signal-safe system calls and ends in _exit.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            // SAFETY: in the child; see `child`.
            unsafe { child(lfd, cfd, timeout_ms) }
        }
        drop(theirs);
        Ok(Drainer { pid, ctl: Some(ours) })
    }

    /// QEMU's connection, once the child has accepted it; `None` when `give_up` says so, the
    /// timeout passes or the child is gone.
    pub(super) fn stream(
        &self,
        timeout: Duration,
        give_up: &dyn Fn() -> bool,
    ) -> io::Result<Option<UnixStream>> {
        let Some(ctl) = self.ctl.as_ref() else { return Ok(None) };
        let t0 = Instant::now();
        loop {
            if give_up() || t0.elapsed() > timeout {
                return Ok(None);
            }
            let mut pfd = libc::pollfd { fd: ctl.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the duration of the call.
            let n = unsafe { libc::poll(&mut pfd, 1, 20) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if n == 0 {
                continue;
            }
            return match recv_fd(ctl.as_raw_fd()).map_err(last_os_error)? {
                // SAFETY: a descriptor just received, owned by nobody else here.
                Some(fd) => Ok(Some(unsafe { UnixStream::from_raw_fd(fd) })),
                None => Ok(None),
            };
        }
    }

    /// The saver is done with the stream: the child exits without reading.
    pub(super) fn finish(&mut self) {
        if let Some(ctl) = self.ctl.take() {
            // SAFETY: one byte from a valid buffer to a descriptor we own.
            unsafe { libc::write(ctl.as_raw_fd(), b"d".as_ptr().cast(), 1) };
            drop(ctl);
            let mut status = 0;
            // SAFETY: our own child.
            unsafe { libc::waitpid(self.pid, &mut status, 0) };
        }
    }
}

impl Drop for Drainer {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Receive one descriptor over `sock`: `Ok(None)` at end of file.
fn recv_fd(sock: RawFd) -> Result<Option<RawFd>, ()> {
    let mut byte = [0u8; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut cbuf = [0u64; 8];
    // SAFETY: zeroed msghdr is valid; its pointers are set to live buffers below.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: msg points to valid buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(());
    }
    if n == 0 {
        return Ok(None);
    }
    // SAFETY: msg was filled by recvmsg; the CMSG macros walk its control buffer.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        if c.is_null() || (*c).cmsg_level != libc::SOL_SOCKET || (*c).cmsg_type != libc::SCM_RIGHTS
        {
            return Err(());
        }
        Ok(Some(std::ptr::read_unaligned(libc::CMSG_DATA(c).cast::<RawFd>())))
    }
}

/// Send descriptor `fd` over `sock` (in the child: no allocation).
unsafe fn send_fd(sock: RawFd, fd: RawFd) {
    let mut byte = [b'f'; 1];
    let mut iov = libc::iovec { iov_base: byte.as_mut_ptr().cast(), iov_len: 1 };
    let mut cbuf = [0u64; 8];
    let mut msg: libc::msghdr = std::mem::zeroed();
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) as _;
    let c = libc::CMSG_FIRSTHDR(&msg);
    (*c).cmsg_level = libc::SOL_SOCKET;
    (*c).cmsg_type = libc::SCM_RIGHTS;
    (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as _;
    std::ptr::write_unaligned(libc::CMSG_DATA(c).cast::<RawFd>(), fd);
    libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL);
}

/// Close every descriptor above 2 but `keep_a` and `keep_b`.
unsafe fn close_others(keep_a: RawFd, keep_b: RawFd) {
    let (a, b) = (keep_a.min(keep_b) as u32, keep_a.max(keep_b) as u32);
    let close = |lo: u32, hi: u32| {
        if lo <= hi {
            libc::syscall(libc::SYS_close_range, lo, hi, 0);
        }
    };
    close(3, a.saturating_sub(1));
    close(a + 1, b.saturating_sub(1));
    close(b + 1, u32::MAX);
}

/// The drain child: never returns.
unsafe fn child(listener: RawFd, ctl: RawFd, timeout_ms: i32) -> ! {
    libc::setsid();
    let null = libc::open(c"/dev/null".as_ptr(), libc::O_RDWR);
    if null >= 0 {
        for fd in 0..3 {
            libc::dup2(null, fd);
        }
    }
    close_others(listener, ctl);
    let mut saver_gone = false;
    let stream = loop {
        let mut pfds = [
            libc::pollfd { fd: listener, events: libc::POLLIN, revents: 0 },
            libc::pollfd {
                fd: if saver_gone { -1 } else { ctl },
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let n = libc::poll(pfds.as_mut_ptr(), 2, timeout_ms);
        if n == 0 {
            libc::_exit(0);
        }
        if n < 0 {
            continue;
        }
        if pfds[1].revents != 0 {
            let mut b = 0u8;
            if libc::read(ctl, (&mut b as *mut u8).cast(), 1) == 1 {
                libc::_exit(0);
            }
            saver_gone = true;
        }
        if pfds[0].revents != 0 {
            let s = libc::accept4(listener, std::ptr::null_mut(), std::ptr::null_mut(), 0);
            if s >= 0 {
                break s;
            }
        }
    };
    libc::close(listener);
    if !saver_gone {
        send_fd(ctl, stream);
        let mut b = 0u8;
        if libc::read(ctl, (&mut b as *mut u8).cast(), 1) == 1 {
            libc::_exit(0);
        }
    }
    let mut buf = [0u8; 16384];
    while libc::read(stream, buf.as_mut_ptr().cast(), buf.len()) > 0 {}
    libc::_exit(0)
}
