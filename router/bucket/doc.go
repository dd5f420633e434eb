// Package bucket maps the HMARK buckets of a tunnel IP to its endpoints: the
// one decision every tunnel router must reach alike (Assign).
package bucket
