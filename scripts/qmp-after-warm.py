#!/usr/bin/env python3
"""How fast QEMU answers a save's set-up queries after the bench harness's host-memory warm.
Boots the idle bench guest (memwork initramfs, golden disk; needs
scripts/fixtures.sh), then N times for each DELAY: touches and frees WARM MiB as
`hostmem::touch` (strata-bench) does (huge pages advised), and from DELAY ms after the free until 300 ms
later times a pipeline of 7 read-only queries (what `vm save` sends first) every ~20 ms.
Prints, per delay, the median and largest round trip and the slow ones as ms@ms-after-the-free.

usage (under the bench lock, nothing else running):
  flock /tmp/strata-bench.lock scripts/qmp-after-warm.py MEM_MIB WARM_MIB N DELAYS_MS
  e.g. scripts/qmp-after-warm.py 2048 2112 4 0,300,600,900,1200,1500,1800,2100,2400"""
import json,os,socket,subprocess,sys,time,mmap,statistics as st
MEM=int(sys.argv[1]); WARM=int(sys.argv[2]); N=int(sys.argv[3])
fx=os.path.join(os.path.dirname(os.path.abspath(__file__)),'..','target','fixtures'); W='/tmp/strata-qmp-after-warm'; os.makedirs(W,exist_ok=True); qs=W+'/q.sock'
try: os.unlink(qs)
except: pass
q=subprocess.Popen(['qemu-system-x86_64','-accel','tcg','-m',str(MEM),'-kernel',fx+'/vmlinuz','-initrd',fx+'/initramfs.cpio.gz','-append','console=ttyS0 strata.mode=mem panic=-1 no_timer_check','-drive',f'file={fx}/golden.img,if=virtio,format=raw,readonly=on','-display','none','-serial','null','-qmp',f'unix:{qs},server=on,wait=off'])
time.sleep(12)
s=socket.socket(socket.AF_UNIX); s.connect(qs); f=s.makefile('rw'); f.readline()
def pipeline(cmds):
    f.write(''.join(json.dumps({'execute':c})+'\n' for c in cmds)); f.flush()
    n=0
    while n<len(cmds):
        x=json.loads(f.readline())
        if 'return' in x or 'error' in x: n+=1
pipeline(['qmp_capabilities'])
Q=['query-migrate','query-migrate-capabilities','query-status','query-machines','query-migrate-parameters','query-version','query-name']
import ctypes
libc=ctypes.CDLL('libc.so.6',use_errno=True)
libc.mmap.restype=ctypes.c_void_p; libc.mmap.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int,ctypes.c_int,ctypes.c_int,ctypes.c_long]
libc.munmap.argtypes=[ctypes.c_void_p,ctypes.c_size_t]; libc.madvise.argtypes=[ctypes.c_void_p,ctypes.c_size_t,ctypes.c_int]
def touch(mib):
    n=mib<<20; p=libc.mmap(None,n,3,0x22,-1,0); libc.madvise(p,n,14)
    b=(ctypes.c_char*n).from_address(p)
    for off in range(0,n,4096): b[off]=b'\x01'
    libc.munmap(p,n)
DEL=[float(x) for x in sys.argv[4].split(',')]
res={d:[] for d in DEL}
try:
    for i in range(N):
        for kind in DEL:
            touch(WARM); t1=time.perf_counter()
            while time.perf_counter()-t1 < kind/1e3 + 0.3:
                time.sleep(max(0,(t1+kind/1e3)-time.perf_counter()) if time.perf_counter()<t1+kind/1e3 else 0.02)
                if time.perf_counter()>=t1+kind/1e3:
                    t=time.perf_counter(); pipeline(Q); res[kind].append(((t-t1)*1e3,(time.perf_counter()-t)*1e3))
    for k,v in res.items():
        l=[x[1] for x in v]; print(k,'n',len(l),'median %.2f'%st.median(l),'max %.2f'%max(l),'over 6 ms',sum(x>6 for x in l), ' '.join('%.0f@%.0f'%(x[1],x[0]) for x in v if x[1]>6))
finally:
    q.kill()
