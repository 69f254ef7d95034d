"""WAN emulation: network namespaces behind shaped links (netem where the kernel has it, else a user-space TUN emulator)."""
