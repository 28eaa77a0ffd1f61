"""What tests and benches share: helpers both tests/ and bench/ import, kept out of the trainer's packages (config,
data, models, parallelisms, training never import it)."""
