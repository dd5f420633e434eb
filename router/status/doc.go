// Package status publishes the tunnel IP a Service is served in its
// status.loadBalancer.ingress (type LoadBalancer Services of no class or of
// class cmd.nu/tunnel), from its own queue, so that API writes never block
// the datapath.
package status
