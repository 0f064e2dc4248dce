"""Execution engines. ``get(name)`` returns the engine a ``Job.run(engine=name)`` uses.

* ``local`` (the default): worker processes on this machine, each hosting many replicas
  (:meth:`tandem.plan.Plan.placement`), TCP on 127.0.0.1 between them.
* ``spark``: one long-running Spark task per worker (the ``tandem_spark`` package from
  ``spark_integration/``), on a session it creates for the run and stops after it; pass a
  ``tandem_spark.SparkEngine(spark)`` object instead to use a session of your own.
"""

from __future__ import annotations

from typing import Any

from tandem.exceptions import ConfigError

ENGINES = ("local", "spark")


def get(name: str, **options: Any) -> Any:
    """The engine called ``name``; ``options`` go to the engine's constructor (for
    ``spark``: e.g. ``master``, the Spark master URL of the session it creates)."""
    if name == "local":
        from tandem.engines.local import LocalEngine

        return LocalEngine(**options)
    if name == "spark":
        try:
            import tandem_spark
        except ImportError as exc:
            raise ConfigError(
                f"the spark engine needs the tandem_spark package and pyspark ({exc}); "
                "install them with `pip install ./spark_integration` from a tandem checkout"
            ) from exc
        return tandem_spark.SparkEngine(**options)
    raise ConfigError(f"unknown engine {name!r}; available engines: {list(ENGINES)}")


__all__ = ["ENGINES", "get"]
