"""The run machinery around the models: everything a training process needs besides
the math (models/), shared by every topology: flags and --config files, the training
loop, metrics, checkpoints, threads, signals, the single-process trainer and the cost
table. ARCHITECTURE.md maps its modules."""
