"""The foundation every layer stands on: the config schema and loader, registries, types, tensor maths,
statistics, answer scoring, errors, the masker and the servers' common pieces."""
