"""tandem on Apache Spark.

```python
import tandem_spark

spark = tandem_spark.local_session(job)  # or any SparkSession set up as documented
engine = tandem_spark.SparkEngine(spark)
result = job.run(duration=30, engine=engine)      # the same td.Result as the local engine
engine.output_df().write.parquet("out/")          # the Collect sink's rows, as a DataFrame
```

Data in and out through Spark: ``tandem_spark.sources.DataFrame(df, order_by=[...])``
replays a DataFrame or table deterministically, ``tandem_spark.sinks.Spark(table=...)``
writes a stream with Spark's writers at the end of the job (:mod:`tandem_spark.sources`,
:mod:`tandem_spark.sinks`).

The engine (:mod:`tandem_spark.engine`) runs every worker of the job (a process hosting many
task replicas, as on the local engine) as one long-running task of a single non-barrier
Spark job; :mod:`tandem_spark.session` builds and checks sessions fit
for that. ``tandem_spark.structured`` (imported on demand: it needs Spark's streaming
sources) is Spark Structured Streaming running the same workload, the passive baseline.
"""

from tandem_spark import sinks, sources
from tandem_spark.engine import SparkEngine
from tandem_spark.session import check_cluster, local_session

__all__ = ["SparkEngine", "check_cluster", "local_session", "sinks", "sources"]
