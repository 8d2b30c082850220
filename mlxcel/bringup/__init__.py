"""Zero-config bring-up: a ``--pp-auto N`` coordinator finds N ``--pp-peer`` processes (a
static list or signed UDP beacons) and pushes each one stage of a pipeline, in two phases,
over the authenticated ``assignment`` channel. See docs/bringup.md."""
