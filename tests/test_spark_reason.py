"""What a failed Spark job's error says about why it failed (no Spark needed)."""

from tandem_spark.engine import spark_reason

PY4J_ERROR = """An error occurred while calling o4248.getResult.
: org.apache.spark.SparkException: Exception thrown in awaitResult:
\tat org.apache.spark.util.SparkThreadUtils$.awaitResult(SparkThreadUtils.scala:70)
\tat py4j.ClientServerConnection.run(ClientServerConnection.java:108)
Caused by: org.apache.spark.SparkException: Job aborted due to stage failure: Task 3 in \
stage 7.0 failed 3 times, most recent failure: Lost task 3.2 in stage 7.0 (TID 31) \
(10.0.0.5 executor driver): org.apache.spark.api.python.PythonException: Traceback \
(most recent call last):
  File "/x/tandem/engines/exchange.py", line 90, in serve
RuntimeError: the twin's cut never came
\tat org.apache.spark.api.python.BasePythonRunner$ReaderIterator.handlePythonException(x)
Driver stacktrace:
\tat org.apache.spark.scheduler.DAGScheduler.failJobAndIndependentStages(x)
"""


def test_a_failed_jobs_reason_is_the_task_that_failed_and_its_traceback_not_the_py4j_stack():
    said = spark_reason(Exception(PY4J_ERROR))
    assert said.splitlines()[0].startswith("Job aborted due to stage failure: Task 3 in stage")
    assert "failed 3 times" in said and said.endswith("RuntimeError: the twin's cut never came")
    assert "awaitResult" not in said and "\tat " not in said and "DAGScheduler" not in said


def test_an_error_with_no_spark_reason_says_its_first_line():
    assert spark_reason(Exception("the connection was reset\nmore")) == "the connection was reset"
    assert spark_reason(KeyError()) == "KeyError"
