"""How ranks start, meet and fail: the process group and its collectives, launchers, failure reports, the flight
recorder. Below every other folder but storage/ and layers/: imports torch and Lightning only."""
