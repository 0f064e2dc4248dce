"""tandem on Spark: the Spark engine and the Structured Streaming passive baseline."""
