"""How iterations run: one driver per mode, one protocol (`rljax.drivers.base.Driver`), one
table of the features each supports (`rljax.drivers.registry.DRIVERS`)."""

from rljax.drivers.base import Driver
from rljax.drivers.registry import DRIVERS, FEATURES, DriverSpec, check_features, driver_name

__all__ = ["Driver", "DRIVERS", "FEATURES", "DriverSpec", "check_features", "driver_name"]
