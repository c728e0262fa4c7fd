"""Lightning training: ConsistencyModule (Algorithm 1), the data module, loggers, checkpoints."""
