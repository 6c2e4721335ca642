"""Integrity on the coordinator's side (issue 43): the evidence kept against each agent, the
exclusion a confirmed fault brings and the rollback bound it sets (ledger.py, exclusion.py,
rollback.py), and the evidence agents' replica checks report (reports.py); docs/architecture.md,
"Integrity"."""
