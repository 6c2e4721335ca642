"""The coordinator's side of issue 43's integrity checks: the evidence agents report."""
