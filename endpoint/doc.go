// Package endpoint will hold the endpoint agent: it enters each local
// endpoint pod's network namespace and adds the tunnel IP with a GRE or MPLS
// decapsulation path. It is not built yet (see README.md, Status).
package endpoint
