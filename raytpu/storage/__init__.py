"""Where runs and data live: parquet tables for Ray Data."""
