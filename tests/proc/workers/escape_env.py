"""A rank that leaves processes behind which dropped group, session *and*
environment (so no job marker): ``setsid env -i sleep`` and a double fork
with a cleared environment. Each writes its pid to --pid_dir, then the
rank exits 0 at once."""

import argparse
import os
import subprocess

p = argparse.ArgumentParser()
p.add_argument("--pid_dir", required=True)
args = p.parse_args()
rank = os.environ["RANK"]

first = subprocess.Popen(["setsid", "env", "-i", "sleep", "301"])  # setsid execs: same pid
with open(os.path.join(args.pid_dir, f"envi_{rank}.pid"), "w") as f:
    f.write(str(first.pid))
path = os.path.join(args.pid_dir, f"daemon_{rank}.pid")
code = ("import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.environ.clear()\n"
        f"        open({path!r}, 'w').write(str(os.getpid()))\n"
        "        os.execv('/bin/sleep', ['sleep', '302'])\n")
subprocess.run(["python3", "-c", code], env={}, check=True)
while not (os.path.exists(path) and open(path).read()):
    pass
print(f"rank {rank} spawned", flush=True)
