"""Dataset loaders: CocoCon-schema contrast sets, the pretraining mixture, GenEval, UReason, drift seeds."""
