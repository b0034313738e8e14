"""The controller and the rank process: starting ranks, running test bodies on them, reporting what happened."""
