// Package router is the tunnel router's Service controller. It watches the
// Services that claim a tunnel IP (the cmd.nu/tunnel annotation), their
// EndpointSlices, the Pods marked for draining and the Nodes; decides which
// Service wins each tunnel IP (internal/tunnelclaim) and which endpoint owns
// each bucket (router/bucket); and hands the datapath (router/datapath) the
// desired state of every tunnel IP. It records the events an operator reads
// on the Services. Event handlers only queue keys; one worker converges.
package router
