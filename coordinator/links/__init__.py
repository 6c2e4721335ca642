"""Link measurement: driving a measurement, the stored matrices, and inferring the links a
sampled measurement skipped (docs/architecture.md, "Layout")."""
