"""The asynchronous RL fleet on Ray (RLAX-style): a parameter server of versioned weights, preemptible rollout
workers, and the trainer-side source that leases prompt groups to them (`FleetSource`, over a worker pool and a
lease book: `pool`, `leases`). Importing this
package needs Ray; `posttrain.rl.fleet.cluster.require_ray` says how to install it when it is missing."""

from posttrain.rl.fleet.cluster import FleetError, require_ray

require_ray()

from posttrain.rl.fleet.follower import FleetFollower, check_hosts  # noqa: E402
from posttrain.rl.fleet.source import FleetSource  # noqa: E402

__all__ = ["FleetSource", "FleetFollower", "FleetError", "check_hosts"]
