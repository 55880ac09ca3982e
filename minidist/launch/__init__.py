"""`python -m minidist.launch`: a job that survives a lost rank (chapter 11, fault tolerance).

One idea: a rank that dies ends the whole MPI job (chapter 2: never hang), and a checkpoint
keeps all but the last few steps (chapter 8: any layout resumes any other's). What is left is
an agent outside the job that notices, cleans up and starts again, as torchrun's elastic agent
does:

    python -m minidist.launch --restarts 3 [--shrink] -n 4 -- python -m minidist.demo --dp 4 \\
        --checkpoint ck --checkpoint-every 10 ...

runs the command after `--` on 4 ranks under mpiexec. When the job fails, the agent makes sure
every process of that attempt is gone, reads the newest complete checkpoint in the command's
`--checkpoint` folder, says what died and what was lost, and starts the same command again,
which resumes from it. With `--shrink` the restart runs on fewer ranks: fewer data-parallel
replicas, each accumulating more micro-batches, so every step still sees the same global batch
and the run stays the same run (to rounding: only summation order changes).

    attempt.py   one attempt: mpiexec started, its output passed through and read, ended for good
    command.py   the ranks' command: its checkpoint folder, its layout, the same run on fewer ranks
    __main__.py  the agent: its flags, and the loop of attempts
"""
