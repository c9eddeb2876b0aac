"""The parts of dtlab-compare, one job each.

    launch.py      run names; the commands of a sync or async run; running one to its end
    processes.py   starting processes, following the trees under them, stopping all of it
    analysis.py    metrics files -> loss curves and the per-run numbers (Omnivore's split)
    report.py      summary.json, report.md and the PNG plots
"""
