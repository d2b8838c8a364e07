"""`python -m benchmarks`: see benchmarks/run.py for the options."""

from benchmarks.run import main

raise SystemExit(main())
