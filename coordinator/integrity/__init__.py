"""Integrity on the coordinator's side (issue 43): the evidence kept against each agent, the
exclusion a confirmed fault brings, and the rollback bound it sets (docs/architecture.md,
"Integrity")."""
