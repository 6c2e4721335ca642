"""The coordinated job: its state machine and the collaborators it delegates to
(docs/architecture.md, "Layout")."""
