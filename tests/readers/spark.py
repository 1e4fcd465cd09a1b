#!/usr/bin/env python3
"""Reads waltail's NDJSON archive with Spark (PySpark in local mode), a reader
we did not write, for the Rust tests. Run it with the python of
scripts/spark.sh's venv (WT_TEST_SPARK_PYTHON):

    python tests/readers/spark.py GLOB

GLOB  the archive's objects, e.g. /copy/*/*/*/*.ndjson* (a folder archive, or a
      copy of an S3 one). Spark decodes each file by its name, as Hadoop's
      codecs do: .ndjson.gz with gzip, .ndjson.zst with zstd (aircompressor's
      pure-Java codec, see below), .ndjson as is.

Output (stdout): one JSON object
  {"changes": rows read, "seqs": distinct seq, "max_seq": highest seq,
   "by_suffix": {".ndjson.gz": rows, ...}, "corrupt": rows Spark could not parse}
"""
import json
import sys

from pyspark.sql import SparkSession
from pyspark.sql import functions as F


def main(glob):
    spark = (
        SparkSession.builder.master("local[1]")
        .appName("waltail-reader")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        # Hadoop's own zstd codec needs a libhadoop built with zstd, which
        # PySpark's wheel lacks ("native zStandard library not available"):
        # the pure-Java one of aircompressor, a jar Spark ships, decodes
        # .zst instead (a codec named here wins for its extension).
        .config("spark.hadoop.io.compression.codecs", "io.airlift.compress.zstd.ZstdCodec")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    df = spark.read.json(glob).withColumn("_file", F.input_file_name()).cache()
    corrupt = df.filter(F.col("_corrupt_record").isNotNull()).count() if "_corrupt_record" in df.columns else 0
    totals = df.agg(F.count("*"), F.countDistinct("seq"), F.max("seq")).collect()[0]
    suffix = (
        F.when(F.col("_file").endswith(".ndjson.gz"), ".ndjson.gz")
        .when(F.col("_file").endswith(".ndjson.zst"), ".ndjson.zst")
        .when(F.col("_file").endswith(".ndjson"), ".ndjson")
        .otherwise("other")
    )
    by_suffix = {r[0]: r[1] for r in df.groupBy(suffix).count().collect()}
    print(
        json.dumps(
            {
                "changes": totals[0],
                "seqs": totals[1],
                "max_seq": totals[2],
                "by_suffix": by_suffix,
                "corrupt": corrupt,
            }
        )
    )
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
