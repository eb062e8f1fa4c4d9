"""The course's self-check, `python check.py STEP`: runs a participant's file next to the
single-process reference and says, per TODO, what works and what to fix.

One module per concern, one per step:
    cli.py       the command line (check.py is a thin entry point to it)
    runs.py      starting a script on 1 or 2 "nodes" through the probe, reference runs, caches
    probe.py     what runs inside each rank: records what the script built, called and printed
    failures.py  a crashed or hung run: the failing rank's own error, and the TODO it belongs to
    status.py    which TODO owns which line of the participant's file, which are not started
    report.py    one line per TODO: ok, not started, or what to fix
    compare.py   losses, weights and optimizer state against the reference
    slurm.py     the job files, run with stand-ins for Slurm, scontrol, srun, torchrun, nsys
    hints.py     hints on demand (`--hint N`), one level more detailed per request
    steps/       one module per step of the course: what each TODO must do
"""
