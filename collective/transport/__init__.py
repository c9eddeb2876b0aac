"""What the collectives stand on: per-communicator links and tags, agreement on buffers,
persistent-request bindings, scratch and page-aligned buffers, ring order and waits,
GPU staging, failure handling and the flight recorder."""
