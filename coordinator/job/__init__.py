"""The coordinated job (docs/architecture.md, "The coordinator's layout, and why").

machine.Job is the state machine; it delegates to membership (which agents), epochplan (an
epoch's layout, grid, split and H), checkpoints (what the checkpoints hold), recovery (the
recovery record), and replan (drift and re-planning, which sees the job only through
`replan.ReplanHost`)."""
