"""`python tests/crash_at.py STEP:STAGE duolm-args...`: run the duolm command, but SIGKILL the process at a
named point, to prove a kill there loses nothing. The kill points live here, not in the library:

    STEP:step      right after optimizer step STEP
    STEP:save      checkpoint STEP's model files written, its train state not yet
    STEP:renamed   checkpoint STEP complete on disk, the manifest not yet naming it
"""
import os
import signal
import sys

import duolm.train.loop as loop
from duolm import runs
from duolm.cli import main


def kill():
    os.kill(os.getpid(), signal.SIGKILL)


def wrap(owner, name, before=None, after=None):
    original = getattr(owner, name)

    def wrapped(*args, **kwargs):
        if before is not None and before(*args, **kwargs):
            kill()
        out = original(*args, **kwargs)
        if after is not None and after(*args, **kwargs):
            kill()
        return out
    setattr(owner, name, wrapped)


if __name__ == "__main__":
    point, argv = sys.argv[1], sys.argv[2:]
    step, stage = int(point.split(":")[0]), point.split(":")[1]
    run_dir = argv[argv.index("-o") + 1]
    calls = [(runs.read_manifest(run_dir) or {}).get("step", 0) if "--resume" in argv else 0]

    def after_step(*a, **k):
        calls[0] += 1
        return calls[0] == step

    if stage == "step":
        wrap(loop, "train_step", after=after_step)
    elif stage == "save":
        wrap(loop, "save", after=lambda model, folder, **k: str(folder).endswith(runs.ckpt_name(step)))
    elif stage == "renamed":
        wrap(runs, "write_manifest", before=lambda run_dir, manifest: manifest["step"] == step)
    else:
        sys.exit(f"unknown stage {stage!r}")
    main(argv)
