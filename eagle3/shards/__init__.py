"""The shard format every stage shares: samples, fp8 storage, checksums, the manifest, conversion."""
