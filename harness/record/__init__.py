"""Recording on the ranks: the per-step recorder, gathering sharded tensors, custom-loop glue, memory, the activation probe."""
