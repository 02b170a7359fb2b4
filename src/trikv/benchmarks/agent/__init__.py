"""The agent benchmark: a scripted coding-agent session over real source files, grown past a memory limit
(`trikv bench agent`, `trikv bench agent-report`)."""
