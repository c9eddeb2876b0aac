"""dtlab-compare: sync against async training of one model on one budget, each method
at its own tuned hyperparameters over several seeds, judged on held-out loss, with what
every run actually did on the record. ARCHITECTURE.md maps its modules."""
