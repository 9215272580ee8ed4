#!/usr/bin/env python3
"""Incremental stop-and-copy saves of the idle bench guest (memwork initramfs, golden disk) into
a store on a versitygw S3 server on loopback: `strata vm save` SAVES times, GAP_S seconds apart,
the guest resumed between them; each save after the first takes the one before as its delta
base (the default). Prints each save's stored bytes, pages and delta pages, then `du`.
Needs scripts/setup.sh and scripts/fixtures.sh.

usage: scripts/incremental-saves.py STRATA_BIN TAG [MEM_MIB=128] [SAVES=3] [GAP_S=5]
       (work files under $INCR_DIR/TAG, default /tmp/strata-incr/TAG; saves.json there)"""
import json,os,socket,subprocess,sys,time,shutil
BIN,TAG=sys.argv[1],sys.argv[2]
MEM=int(sys.argv[3]) if len(sys.argv)>3 else 128
SAVES=int(sys.argv[4]) if len(sys.argv)>4 else 3
GAP=float(sys.argv[5]) if len(sys.argv)>5 else 5
W=os.environ.get("INCR_DIR","/tmp/strata-incr")+f"/{TAG}"; shutil.rmtree(W,ignore_errors=True); os.makedirs(W+'/s3/bkt')
port=7400+os.getpid()%500
env=dict(os.environ,AWS_ENDPOINT_URL=f'http://127.0.0.1:{port}',AWS_ACCESS_KEY_ID='k',AWS_SECRET_ACCESS_KEY='secretsecret',AWS_REGION='us-east-1',AWS_ALLOW_HTTP='true',STRATA_STORE=W+'/meta')
gw=subprocess.Popen([os.path.expanduser('~/go/bin/versitygw'),'--access','k','--secret','secretsecret','--port',f'127.0.0.1:{port}','--quiet','posix',W+'/s3'],stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL)
time.sleep(1.5)
r=subprocess.run([BIN,'init','--backend','s3://bkt'],env=env,capture_output=True,text=True); print('init',r.returncode,r.stderr.strip()[:300])
fx=os.path.join(os.path.dirname(os.path.abspath(__file__)),'..','target','fixtures')
qs=W+'/q.sock'
q=subprocess.Popen(['qemu-system-x86_64','-accel','tcg','-m',str(MEM),'-kernel',fx+'/vmlinuz','-initrd',fx+'/initramfs.cpio.gz','-append','console=ttyS0 strata.mode=mem panic=-1 no_timer_check','-drive',f'file={fx}/golden.img,if=virtio,format=raw,readonly=on','-display','none','-serial','null','-qmp',f'unix:{qs},server=on,wait=off','-qmp',f'unix:{qs}2,server=on,wait=off'])
time.sleep(12)
s=socket.socket(socket.AF_UNIX); s.connect(qs+'2'); f=s.makefile('rw'); f.readline()
def cmd(c,a=None):
    f.write(json.dumps({'execute':c,**({'arguments':a} if a else {})})+'\n'); f.flush()
    while True:
        x=json.loads(f.readline())
        if 'return' in x or 'error' in x: return x
cmd('qmp_capabilities')
out=[]
try:
    for i in range(SAVES):
        r=subprocess.run([BIN,'vm','save','--json','--qmp',qs,f'd{i}'],env=env,capture_output=True,text=True)
        if r.returncode: print('save failed',r.stderr); break
        j=json.loads(r.stdout); out.append(j)
        d=j.get('delta') or {}
        print(f"save {i}: stored {j['stored_bytes']/1e6:.3f} MB, pages stored {j['pages_stored']}, deduped {j['pages_deduped']}, delta pages {d.get('pages')} records {d.get('records')} attempts {d.get('attempts')}, total {j['total_ms']:.0f} ms")
        print(cmd('cont'))
        time.sleep(GAP)
    du=subprocess.run([BIN,'--json','du'],env=env,capture_output=True,text=True); print('du',du.stdout.strip()[:400])
finally:
    q.kill(); gw.kill()
json.dump(out,open(W+'/saves.json','w'))
