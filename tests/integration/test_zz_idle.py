import os, time, collections, subprocess

def cpu():
    out = collections.Counter()
    for pid in os.listdir('/proc'):
        if pid.isdigit():
            try:
                fields = open(f'/proc/{pid}/stat').read().rsplit(')', 1)[1].split()
            except OSError:
                continue
            out[pid] = int(fields[11]) + int(fields[12])
    return out

def test_idle(server):
    print("\nIDLE replicas", subprocess.run("ps -eo args | grep -c '^ray::ServeReplica'", shell=True, capture_output=True, text=True).stdout)
    time.sleep(30)
    a = cpu(); t0 = time.time(); time.sleep(30); b = cpu(); dt = time.time() - t0
    print(f"IDLE total {sum(max(0, b[k] - a.get(k, 0)) for k in b)/dt:.1f}% of one core")
