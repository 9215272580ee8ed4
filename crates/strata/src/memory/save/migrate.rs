//! Steps 3 and 4 of a save: listen on a unix socket, `migrate` into it and poll QEMU while a
//! receive thread runs the pipeline (`ingest`); whichever side fails first stops the other.
//! Kept apart from the sequence in `mod.rs`, which only sets up, calls [`run`] and commits.

use super::drain::Drainer;
use super::*;

fn ev_time(e: &QmpEvent) -> f64 {
    e.seconds as f64 + e.microseconds as f64 / 1e6
}

/// Pause between the first STOP and the following RESUME, in ms.
pub(super) fn pause_from_events(events: &[QmpEvent]) -> Option<f64> {
    let stop = events.iter().position(|e| e.name == "STOP")?;
    let resume = events[stop..].iter().find(|e| e.name == "RESUME")?;
    Some((ev_time(resume) - ev_time(&events[stop])) * 1e3)
}

/// Time of the RESUME that follows the first STOP, wall-clock microseconds.
pub(super) fn resume_time_us(events: &[QmpEvent]) -> Option<u64> {
    let stop = events.iter().position(|e| e.name == "STOP")?;
    let resume = events[stop..].iter().find(|e| e.name == "RESUME")?;
    Some(resume.seconds as u64 * 1_000_000 + resume.microseconds as u64)
}

/// Where the receiving thread keeps its end of the socket, so the QMP side can shut it down.
struct Conn {
    stream: Mutex<Option<UnixStream>>,
    cancel: AtomicBool,
    /// Stream bytes received so far.
    bytes: AtomicU64,
}

impl Conn {
    fn shutdown(&self) {
        self.cancel.store(true, Ordering::SeqCst);
        if let Some(s) = self.stream.lock().as_ref() {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

enum RxError {
    NoConnection,
    Accept(std::io::Error),
    Ingest(IngestError, u64),
}

fn accept(listener: &UnixListener, conn: &Conn, timeout: Duration) -> Result<UnixStream, RxError> {
    listener.set_nonblocking(true).map_err(RxError::Accept)?;
    let t0 = Instant::now();
    loop {
        match listener.accept() {
            Ok((s, _)) => {
                s.set_nonblocking(false).map_err(RxError::Accept)?;
                return Ok(s);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if conn.cancel.load(Ordering::SeqCst) || t0.elapsed() > timeout {
                    return Err(RxError::NoConnection);
                }
                // Wake as soon as QEMU connects (a sleep-and-retry loop cost a save up to its
                // sleep before the first byte), and every 20 ms to look at cancel and timeout.
                let mut pfd =
                    libc::pollfd { fd: listener.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // SAFETY: one valid pollfd for the duration of the call.
                unsafe { libc::poll(&mut pfd, 1, 20) };
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(RxError::Accept(e)),
        }
    }
}

/// Counts bytes read so a cut stream can say how far it got.
struct Counting<'a> {
    s: &'a UnixStream,
    n: &'a AtomicU64,
}

impl std::io::Read for Counting<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = std::io::Read::read(&mut self.s, buf)?;
        self.n.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

#[allow(clippy::too_many_arguments)]
fn receive(
    listener: UnixListener,
    drainer: Option<&Drainer>,
    conn: &Conn,
    timeout: Duration,
    session: &Session,
    chooser: &Chooser,
    opts: &IngestOptions,
    progress: &dyn Progress,
) -> Result<Ingested, RxError> {
    let s = match drainer {
        Some(d) => {
            drop(listener);
            let give_up = || conn.cancel.load(Ordering::SeqCst);
            d.stream(timeout, &give_up).map_err(RxError::Accept)?.ok_or(RxError::NoConnection)?
        }
        None => {
            let s = accept(&listener, conn, timeout)?;
            drop(listener);
            s
        }
    };
    if let Ok(c) = s.try_clone() {
        *conn.stream.lock() = Some(c);
    }
    if conn.cancel.load(Ordering::SeqCst) {
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
    let mut src = Counting { s: &s, n: &conn.bytes };
    ingest(&mut src, session, chooser, opts, progress).map_err(|e| {
        // Stop QEMU at once: a stop-and-copy source writes its last pass holding the big
        // QEMU lock, so if nobody reads (the store failed) its monitor hangs until the socket
        // goes away.
        let _ = s.shutdown(std::net::Shutdown::Both);
        RxError::Ingest(e, conn.bytes.load(Ordering::Relaxed))
    })
}

pub(super) struct Timing {
    pub(super) session: Session,
    pub(super) raw_before: u64,
    pub(super) stored_before: u64,
    pub(super) downtime_ms: f64,
    pub(super) pause_ms: Option<f64>,
    /// QEMU's RESUME event after the first STOP, wall-clock microseconds.
    pub(super) resumed_us: Option<u64>,
    pub(super) migrate_ms: f64,
    pub(super) setup_ms: f64,
}

/// Steps 3 and 4: migrate into the socket while the pipeline stores what arrives.
#[allow(clippy::too_many_arguments)]
pub(super) fn run(
    store: &Store,
    qmp: &mut QmpClient,
    name: &str,
    opts: &SaveOptions,
    chooser: &Chooser,
    was_running: bool,
    settings: &[Request],
    mut disks: Option<&mut (dyn DiskCut + '_)>,
    on_migrating: &mut dyn FnMut(),
    check: &mut dyn FnMut() -> Result<(), MemError>,
    progress: &dyn Progress,
    t0: Instant,
) -> Result<(Ingested, Timing), MemError> {
    let path = qmp.path().to_path_buf();
    let q = |op| MemError::qmp(op, &path);
    let dir = opts.socket_dir.clone().unwrap_or_else(std::env::temp_dir);
    let sock =
        dir.join(format!("strata-mig-{}-{:08x}.sock", std::process::id(), rand::random::<u32>()));
    let listener = UnixListener::bind(&sock).map_err(|source| MemError::Io {
        op: "listen",
        path: sock.clone(),
        source,
    })?;
    let _cleanup = RemoveOnDrop(&sock);
    // A background snapshot's stream is drained to its end if this process dies (`drain`).
    let mut drainer =
        if opts.mode == Mode::BackgroundSnapshot {
            Some(Drainer::start(&listener, opts.connect_timeout).map_err(|source| {
                MemError::Io { op: "fork the stream's drain child", path: sock.clone(), source }
            })?)
        } else {
            None
        };
    let session = store.session();
    let st = store.stats();
    let raw_before = st.raw_bytes_new.load(Ordering::Relaxed);
    let stored_before = st.stored_bytes_new.load(Ordering::Relaxed);
    let conn =
        Conn { stream: Mutex::new(None), cancel: AtomicBool::new(false), bytes: AtomicU64::new(0) };
    qmp.take_events();

    // The settings, `stop` (a save of a running guest) and `migrate` go in one write: one
    // round trip instead of three (~1.1 ms of a save's set-up). QEMU runs them in
    // order, so a refused setting has already let the guest stop and the migration start:
    // both are undone (`migrate_cancel` here, the caller resumes the guest). A desktop
    // snapshot (`disks`) stops a running guest in every mode but precopy, and cuts the disks
    // between `stop` and `migrate`: `migrate` goes out only after the cut.
    let placement = disks.as_ref().map(|d| d.placement());
    let at_flush = placement == Some(Placement::AtFlush) && opts.mode == Mode::BackgroundSnapshot;
    let cut_at_stop = disks.is_some() && opts.mode != Mode::Precopy && !at_flush;
    if at_flush {
        cut_disks(disks.as_deref_mut(), Placement::AtFlush, name)?;
    }
    let stop = was_running && (opts.mode == Mode::Save || cut_at_stop);
    let uri = format!("unix:{}", sock.display());
    let migrate = ("migrate", Some(serde_json::json!({ "uri": uri })));
    let mut reqs: Vec<Request> = settings.to_vec();
    if stop {
        reqs.push(("stop", None));
    }
    if !cut_at_stop {
        reqs.push(migrate.clone());
    }
    qmp.send_pipeline(&reqs).map_err(q("migrate"))?;
    let checked = (|| {
        for (cmd, args) in settings {
            qmp.execute(cmd, args.clone()).map_err(q(cmd))?;
        }
        Ok(())
    })();
    if let Err(e) = checked {
        qmp.discard_pipelined();
        let _ = qmp.migrate_cancel();
        return Err(e);
    }
    let mut t_stop = None;
    if stop {
        qmp.stop().map_err(q("stop"))?;
        t_stop = Some(Instant::now());
    }
    if cut_at_stop {
        cut_disks(disks.as_deref_mut(), Placement::AtStop, name)?;
        qmp.send_pipeline(&[migrate]).map_err(q("migrate"))?;
    }
    on_migrating();
    let t_migrate = Instant::now();
    let setup_ms = t_migrate.duration_since(t0).as_secs_f64() * 1e3;
    tracing::debug!(target: "strata::memory", setup_ms, stop_ms = t_stop.map(|t| t.duration_since(t0).as_secs_f64() * 1e3), "save: migrating");
    let outcome = std::thread::scope(|s| {
        let rx = std::thread::Builder::new()
            .name("strata-mem-parse".into())
            .spawn_scoped(s, || {
                let r = receive(
                    listener,
                    drainer.as_ref(),
                    &conn,
                    opts.connect_timeout,
                    &session,
                    chooser,
                    &opts.ingest,
                    progress,
                );
                if r.is_ok() {
                    // Every page is in the store: the last data pack starts uploading now, not
                    // after QEMU has said "completed" or the page maps are written (best
                    // effort; a failure here shows again at the commit's flush).
                    if let Err(e) = store.seal_for_upload() {
                        tracing::debug!(target: TARGET, error = %e, "early seal of the last pack failed");
                    }
                }
                r
            })
            .expect("spawn parse thread");
        let at_switchover = if cut_at_stop || at_flush { None } else { disks };
        let src = wait_source(qmp, &conn, &sock, &rx, name, at_switchover, check);
        if src.is_err() {
            conn.shutdown();
        }
        (src, rx.join())
    });
    let migrate_ms = t_migrate.elapsed().as_secs_f64() * 1e3;
    if let Some(d) = drainer.as_mut() {
        d.finish();
    }
    let (src, rx) = outcome;
    let rx = rx.map_err(|_| MemError::Panic { what: "parse" })?;
    let info = match (src, rx) {
        (Ok(info), Ok(ing)) => (info, ing),
        // The store failed first and we cut the stream: QEMU's failure is only the echo.
        (Err(_), Err(RxError::Ingest(e @ IngestError::Store(_), bytes))) => {
            return Err(ingest_error(e, name, bytes))
        }
        (Err(e), _) => return Err(e),
        (Ok(_), Err(RxError::NoConnection)) => {
            return Err(MemError::NoConnection {
                path: sock.clone(),
                secs: opts.connect_timeout.as_secs(),
            })
        }
        (Ok(_), Err(RxError::Accept(source))) => {
            return Err(MemError::Io { op: "accept", path: sock.clone(), source })
        }
        (Ok(_), Err(RxError::Ingest(e, bytes))) => return Err(ingest_error(e, name, bytes)),
    };
    let (mig, ingested) = info;
    if opts.mode == Mode::Precopy && was_running {
        qmp.cont().map_err(q("cont"))?;
    }
    if stop && opts.mode == Mode::BackgroundSnapshot {
        // QEMU 7.2 starts the guest after the device state whatever its state before; later
        // versions put back the state they found, which is the desktop snapshot's `stop`.
        if !qmp.query_status().map_err(q("query-status"))?.running {
            qmp.cont().map_err(q("cont"))?;
        }
    }
    // Collect STOP/RESUME events that arrived with the last replies.
    let _ = qmp.poll_events(Duration::from_millis(0));
    let events = qmp.take_events();
    let pause_ms = if opts.mode == Mode::Save { None } else { pause_from_events(&events) };
    let resumed_us = resume_time_us(&events);
    let downtime_ms = match (opts.mode, t_stop) {
        (Mode::Save, Some(t)) => t.elapsed().as_secs_f64() * 1e3,
        (Mode::Save, None) => 0.0,
        _ => mig.and_then(|m| m.downtime_ms).map(|d| d as f64).or(pause_ms).unwrap_or(0.0),
    };
    tracing::debug!(target: TARGET, name, downtime_ms, ?pause_ms, since_start_ms = t0.elapsed().as_millis() as u64, "stream received");
    Ok((
        ingested,
        Timing {
            session,
            raw_before,
            stored_before,
            downtime_ms,
            pause_ms,
            resumed_us,
            migrate_ms,
            setup_ms,
        },
    ))
}

/// Cut the disks of a desktop snapshot (guest stopped, block layer flushed).
fn cut_disks(
    disks: Option<&mut (dyn DiskCut + '_)>,
    at: Placement,
    name: &str,
) -> Result<(), MemError> {
    let Some(d) = disks else { return Ok(()) };
    let t = Instant::now();
    d.cut(at).map_err(|reason| MemError::DiskCut { name: name.into(), reason })?;
    tracing::debug!(target: TARGET, name, cut_ms = t.elapsed().as_secs_f64() * 1e3, "desktop snapshot: disks cut");
    Ok(())
}

fn ingest_error(e: IngestError, name: &str, bytes: u64) -> MemError {
    match e {
        IngestError::Store(source) => {
            MemError::Store { op: "page write", name: name.into(), source }
        }
        IngestError::Stream(source @ crate::memory::stream::StreamError::Truncated { .. })
            if bytes > 0 =>
        {
            // A cut stream: most likely QEMU died; the parse error carries the offset.
            MemError::Stream { name: name.into(), source }
        }
        IngestError::Stream(source) => MemError::Stream { name: name.into(), source },
        IngestError::Read { source, .. } => {
            MemError::Io { op: "read of the migration stream", path: PathBuf::from(name), source }
        }
        IngestError::Panic => MemError::Panic { what: "pipeline" },
    }
}

struct RemoveOnDrop<'a>(&'a Path);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(self.0);
    }
}

/// Start the migration and poll QEMU until it completes, fails, or the pipeline fails.
fn wait_source<T>(
    qmp: &mut QmpClient,
    conn: &Conn,
    sock: &Path,
    rx: &std::thread::ScopedJoinHandle<'_, Result<T, RxError>>,
    name: &str,
    mut at_switchover: Option<&mut (dyn DiskCut + '_)>,
    check: &mut dyn FnMut() -> Result<(), MemError>,
) -> Result<Option<crate::qmp::MigrationInfo>, MemError> {
    let path = qmp.path().to_path_buf();
    let died =
        |_| MemError::SourceDied { name: name.into(), bytes: conn.bytes.load(Ordering::Relaxed) };
    // Its reply was read ahead with the settings' (`run`).
    if let Err(e) = qmp.migrate(&format!("unix:{}", sock.display())) {
        return Err(match e {
            QmpError::Closed { .. } => died(0),
            source => MemError::Qmp { op: "migrate", path, source },
        });
    }
    loop {
        match qmp.query_migrate() {
            Ok(info) => match info.status.as_str() {
                "completed" => return Ok(Some(info)),
                // A precopy desktop snapshot: the guest is stopped at switchover, before its
                // device state; cut the disks, then let QEMU go on.
                "pre-switchover" if at_switchover.is_some() => {
                    if let Err(e) = cut_disks(at_switchover.take(), Placement::AtStop, name) {
                        let _ = qmp.migrate_cancel();
                        conn.shutdown();
                        return Err(e);
                    }
                    let cont = serde_json::json!({ "state": "pre-switchover" });
                    qmp.execute("migrate-continue", Some(cont)).map_err(|source| {
                        MemError::Qmp { op: "migrate-continue", path: path.clone(), source }
                    })?;
                    continue;
                }
                "failed" | "cancelled" => {
                    return Err(MemError::SourceFailed {
                        name: name.into(),
                        status: info.status.clone(),
                        desc: info
                            .error_desc
                            .clone()
                            .unwrap_or_else(|| "QEMU gave no reason".into()),
                    })
                }
                _ => {}
            },
            Err(QmpError::Closed { .. }) => return Err(died(0)),
            Err(source) => return Err(MemError::Qmp { op: "query-migrate", path, source }),
        }
        // A check that came back during the stream (the ref listing, `listing.rs`) can stop
        // the save: the migration is cancelled and the caller resumes the guest.
        if let Err(e) = check() {
            let _ = qmp.migrate_cancel();
            conn.shutdown();
            return Err(e);
        }
        if rx.is_finished() {
            // The pipeline ended before QEMU said "completed": either it failed (cancel the
            // migration so QEMU resumes/unblocks) or the stream ended and QEMU is about to
            // report completion.
            for _ in 0..1000 {
                match qmp.query_migrate() {
                    Ok(i) if i.status == "completed" => return Ok(Some(i)),
                    Ok(i) if i.status == "failed" || i.status == "cancelled" => break,
                    Err(QmpError::Closed { .. }) => return Err(died(0)),
                    _ => std::thread::sleep(Duration::from_millis(1)),
                }
            }
            let _ = qmp.migrate_cancel();
            conn.shutdown();
            // The receiver's outcome decides: its error is the real cause, and a stream that
            // ended correctly is complete whatever QEMU reports late.
            return Ok(None);
        }
        // Poll QEMU every 10 ms, but look at the receiver every 1 ms: the commit waits for
        // this loop, and the stream's end is when QEMU is about to say "completed".
        for _ in 0..10 {
            if rx.is_finished() {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}
