"""The run machinery around the models: everything a training process needs besides
the math (models/), shared by every topology.

    session.py     flags and --config files -> configs -> model, params, optimizer, data
    trainer.py     the training loop, checkpoints and resume, the run's Summary
    metrics.py     JSON-lines metrics with a header that can rerun the run
    progress.py    progress lines (a redrawn bar on a terminal)
    checkpoint.py  atomic, digest-verified checkpoint directories
    threads.py     BLAS/OpenMP threads: the host's cores shared by its processes
    launcher.py    rank, size and local size from mpiexec/srun's environment
    cli.py         program names and run_cli (errors, Ctrl-C, exit status)
    train.py       single-process training (dtlab-train)
    cost.py        the cost estimator's table (dtlab-cost)
"""
