"""The one bound the tests put on a single await that depends on a peer, a device or another
process: generous, because Python runs several times slower under the VM's software
emulation. A bound, never a rate: a test that hits it has hung, not been slow."""

STEP = 60.0
