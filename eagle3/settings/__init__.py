"""The run YAML's section schemas (one pydantic model per section) and the YAML loader; the run config that
holds them is :mod:`eagle3.config`."""
