"""The sections of the quality results page (`report.write_report` assembles them), one module per part:

- `cells`: reading a run's result tables and writing their figures (shared by every section)
- `tables`: one run's tables, section by section, as Markdown or plain text, and its CSV rows
- `plots`: one run's PNG plots
- `verdicts`: how TriAttention is judged against each method (interval verdicts, sign test, diagnosis)
- `summary`: the opening summary over every run, and the scope of what was measured
- `trace_sets`: the validity and sampling of the reasoning-trace sets
- `preregistration`: the pre-registered held-out tests and their outcomes
"""
