"""`python -m minidist.plan`: the planner's command line (minidist/plan/search.py)."""
import sys

from minidist.plan.search import main

sys.exit(main())
