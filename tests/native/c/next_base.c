/* The bottom of the RTLD_NEXT chain: libtop's layer() must reach this one. */
int layer(void) { return 1; }
