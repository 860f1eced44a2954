"""Run inside a fresh PID namespace (unshare --pid --fork --mount-proc, as root).

A dsrun job whose rank 0 exits at once while rank 1 waits; a stand-in
process - someone else's, leading its own group - is then started with rank
0's old pid if the kernel lets that pid be reused (ns_last_pid), and rank 1
fails, so the job is torn down. Prints one JSON line: whether the stand-in
got rank 0's pid and whether it survived the teardown.
"""

import json
import os
import subprocess
import sys
import time

pid_dir, go = sys.argv[1], sys.argv[2]
WORKER = f"""
import os, sys, time
rank = os.environ["RANK"]
open(os.path.join({pid_dir!r}, "rank_" + rank), "w").write(str(os.getpid()))
if rank == "0":
    sys.exit(0)
while not os.path.exists({go!r}):
    time.sleep(0.02)
sys.exit(3)
"""
script = os.path.join(pid_dir, "..", "worker.py")
with open(script, "w") as f:
    f.write(WORKER)
job = subprocess.Popen([sys.executable, "-m", "dsrun.launcher.cli", "--cpu", "--num_gpus", "2",
                        "--dist_backend", "none", "--kill_grace", "1", script],
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
target = None
end = time.monotonic() + 30
while target is None and time.monotonic() < end:
    try:
        target = int(open(os.path.join(pid_dir, "rank_0")).read())
    except (OSError, ValueError):
        time.sleep(0.02)


def gone_or_zombie(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


while not gone_or_zombie(target):
    time.sleep(0.02)
time.sleep(0.3)  # an agent that reaps rank 0 has done so by now
stand_in = None
for _ in range(200):
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(target - 1))
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    if proc.pid == target:
        stand_in = proc
        break
    proc.kill()
    proc.wait()
if stand_in is None:  # the pid is still held (by a zombie): a stand-in elsewhere
    stand_in = subprocess.Popen(["sleep", "60"], start_new_session=True)
open(go, "w").close()
job.wait(timeout=60)
time.sleep(0.5)
alive = stand_in.poll() is None
print(json.dumps({"reused": stand_in.pid == target, "survived": alive,
                  "job_rc": job.returncode}))
stand_in.kill()
