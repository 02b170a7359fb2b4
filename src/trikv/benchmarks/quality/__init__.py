"""Quality benchmarks: how much each method keeps the model right, at every budget.

Tasks: fidelity + attention recall (teacher-forced long texts), DFS state query, needle / passkey, math.
Entry points: `trikv bench quality` (`runner.run_quality`) and `trikv bench report` (`report.write_report`).
"""
