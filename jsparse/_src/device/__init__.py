"""Device programs: jitted code that runs where the parameters live (ranks in the exponent-class
order, ulp codes, block ranks of split leaves, bit packing of the packed coding). Nothing here
reads or writes bytes on the host; ``wire/`` holds the host byte formats built on these."""
