"""Certificates: writing the proof of a run (manifest + Parquet obligations) and checking it independently."""
from tv_ray.certificate.check import CheckReport, check_certificate
from tv_ray.certificate.write import write_certificate

__all__ = ["write_certificate", "check_certificate", "CheckReport"]
