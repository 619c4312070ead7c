"""dflash-pipeline: train DFlash speculative-decoding drafters from an offline feature store."""

__version__ = "0.1.0"
