package router

import (
	"time"

	"github.com/cmdnu/kube-service-tunnel/internal/tunnelclaim"
	"github.com/cmdnu/kube-service-tunnel/router/datapath"
)

// DefaultResyncPeriod is how often the controller hands the datapath the
// whole desired state, which compares it with the kernel and repairs it.
const DefaultResyncPeriod = 5 * time.Minute

// Config is the tunnel router's configuration: the datapath's, which every
// router must share, and what the controller decides with.
type Config struct {
	datapath.Config
	// ResyncPeriod is how often the whole kernel state is compared with the
	// desired state and repaired.
	ResyncPeriod time.Duration
	// Policy decides which Services may have their tunnel IP (the address
	// pools); the endpoint agents must have the same one.
	Policy tunnelclaim.Policy
}
