"""What the machine is: device memory and rates, interconnects, compute efficiency, calibration files."""
