"""The planner and the memory arithmetic (chapter 9; memory from chapter 1 on).

    memory.py          bytes of parameters, gradients, optimizer states and activations per rank
    predict.py         one layout's memory and step time on a cluster, from formulas
    shared_cores.py    more ranks than cores: a step with the cores shared as the ranks share them
    search.py          every valid layout, predicted and ranked (`python -m minidist.plan`)
    recompute_cost.py  what activation recomputation saves and costs, measured (chapter 11)

Nothing here trains: the trainers import `memory` for their ledgers, and the planner imports the
layout rule (`minidist/training/layout.py`) so that it ranks only layouts the demo runs.
"""
