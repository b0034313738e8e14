"""What ``python -m harness diagnose`` runs: targets, the bundled ones, driving them on ranks."""
